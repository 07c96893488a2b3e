"""safetensors headers, read and checked without reading any tensor data, and the plan of output shards: torch-free,
so that a plan (`convert-gqa --dry-run`, `gqakit uptrain --plan`) reads a checkpoint without loading torch.
`checkpoint.py` reads and writes the tensors themselves."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gqakit.common.errors import GqakitError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
# Bytes per element of each safetensors dtype gqakit reads (checkpoint.DTYPES: the same names, as torch dtypes)
ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}
CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # a --dtype name's code

if TYPE_CHECKING:  # torch only in annotations: the module imports without it
    import torch


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype name (safetensors spelling), shape and absolute byte range."""

    file: Path | None
    dtype: str
    shape: tuple[int, ...]
    start: int = 0
    end: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZES[self.dtype]


@dataclasses.dataclass(frozen=True)
class DerivedTensor(TensorInfo):
    """A tensor computed from stored ones (re-hosting a family on another class: a transpose, a split of a fused
    projection, a folded norm). `file` and `start` are those of its first source, so plans keep reading in file
    order; `make()` reads the sources (through `load_tensor`) and returns the tensor. Never byte-copied."""

    make: Callable[[], torch.Tensor] | None = None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: Path, name: str, entry, base: int) -> TensorInfo:
    """One header entry, checked: dtype known, shape and offsets non-negative ints, size = shape x dtype."""
    corrupt = GqakitError(f"{path}: tensor '{name}' has a corrupt header entry; re-download or re-save the checkpoint")
    if not isinstance(entry, dict):
        raise corrupt
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(map(_is_count, shape))):
        raise corrupt
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1]):
        raise corrupt
    if not isinstance(dtype, str):
        raise corrupt
    if dtype not in ITEMSIZES:
        raise GqakitError(f"{path}: tensor '{name}' has dtype {dtype}, which gqakit cannot convert (it reads "
                          f"{', '.join(ITEMSIZES)}); convert a checkpoint saved in one of those")
    info = TensorInfo(path, dtype, tuple(shape), base + offsets[0], base + offsets[1])
    if offsets[1] - offsets[0] != info.nbytes:
        raise GqakitError(f"{path}: tensor '{name}' spans {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs "
                          f"{info.nbytes}; re-download or re-save the checkpoint")
    return info


def _check_layout(path: Path, tensors: dict[str, TensorInfo], base: int, size: int) -> None:
    """The tensors' byte ranges must tile the data exactly: no two share a byte and none leaves a gap."""
    at = base
    for start, end, name in sorted((info.start, info.end, name) for name, info in tensors.items()):
        if start != at:
            what = "overlaps the tensor before it" if start < at else "leaves a gap after the tensor before it"
            raise GqakitError(f"{path}: tensor '{name}' starts at data byte {start - base}, which {what} (ends at "
                              f"{at - base}); the file is corrupt: re-download or re-save the checkpoint")
        at = end
    if at != size:
        raise GqakitError(
            f"{path} is truncated or corrupt: its header needs {at} bytes, the file has "
            f"{size}; re-download or re-save the checkpoint"
        )


def _is_str_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header without reading any tensor data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header claims {n} bytes but the file has {size - 8}")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise GqakitError(
            f"{path} is not a readable safetensors file ({e}); re-download or re-save the checkpoint"
        ) from None
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not _is_str_map(metadata):
        raise GqakitError(f"{path}: its __metadata__ is not a mapping of strings to strings; re-save the checkpoint")
    tensors = {name: _entry(path, name, entry, 8 + n) for name, entry in header.items()}
    _check_layout(path, tensors, 8 + n, size)
    return tensors, metadata


def _read_index(index: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name in the same folder), checked."""
    try:
        data = json.loads(index.read_text())
    except (ValueError, RecursionError) as e:
        raise GqakitError(f"{index} is not valid JSON ({e}); re-download or re-save the checkpoint") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not _is_str_map(weight_map):
        raise GqakitError(f"{index} has no 'weight_map' object mapping tensor names to shard file names; "
                          "re-download or re-save the checkpoint")
    if not weight_map:
        raise GqakitError(f"{index} lists no tensors; re-download or re-save the checkpoint")
    for shard in weight_map.values():
        if shard in ("", ".", "..") or os.path.basename(shard) != shard:
            raise GqakitError(f"{index} names shard {shard!r}, which is not a file name in {index.parent}; "
                              "re-download or re-save the checkpoint")
    return weight_map


def scan_checkpoint(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of a safetensors checkpoint folder (single file or index + shards), validated."""
    index = model_dir / INDEX
    if (model_dir / SINGLE).is_file():  # first, as transformers looks: beside it an index (and its shards) is unread
        shards, weight_map = [SINGLE], None
    elif index.is_file():
        weight_map = _read_index(index)
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise GqakitError(
                f"{index} names shard {missing[0]} which is missing from {model_dir}"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; download the complete checkpoint"
            )
    else:
        pickled = [p for p in PICKLED if (model_dir / p).exists()] or sorted(
            p.name for p in model_dir.glob("pytorch_model-*.bin"))
        if pickled:
            raise GqakitError(
                f"{model_dir} has only pickled weights ({pickled[0]}), which gqakit will not unpickle; "
                "convert them to safetensors first, e.g. `AutoModelForCausalLM.from_pretrained(dir)"
                ".save_pretrained(new_dir)` on a source you trust"
            )
        raise GqakitError(f"{model_dir} has no {SINGLE} or {INDEX}; point at a Hugging Face checkpoint folder")
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        found, _ = read_header(model_dir / shard)
        twice = sorted(found.keys() & tensors.keys())
        if twice:
            raise GqakitError(f"tensor '{twice[0]}' is in both {tensors[twice[0]].file.name} and {shard}; "
                              "re-download or re-save the checkpoint")
        tensors.update(found)
    if weight_map is not None:
        absent = [k for k, s in weight_map.items() if k not in tensors]
        if absent:
            raise GqakitError(f"{index} lists '{absent[0]}' but no shard holds it; re-save the checkpoint")
    return tensors


def same_bytes(a: TensorInfo, b: TensorInfo, block: int = 1 << 24) -> bool:
    """Whether two stored tensors hold the same dtype, shape and bytes, read `block` bytes at a time (memory stays
    flat at any size); a tensor with no file (a meta plan's) or a derived one is never known equal."""
    if (a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape) or a.file is None or b.file is None
            or isinstance(a, DerivedTensor) or isinstance(b, DerivedTensor)):
        return False
    if Path(a.file) == Path(b.file) and a.start == b.start:
        return True
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        fa.seek(a.start)
        fb.seek(b.start)
        for offset in range(0, a.end - a.start, block):
            n = min(block, a.end - a.start - offset)
            if fa.read(n) != fb.read(n):
                return False
    return True


def assign_shards(entries: list[tuple[str, str, tuple[int, ...]]], max_shard_bytes: int) -> list[list[int]]:
    """Split tensors (in order) into consecutive shards of at most `max_shard_bytes` each.

    A tensor larger than the cap gets a shard of its own, as `save_pretrained` does.
    """
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, dtype, shape) in enumerate(entries):
        nbytes = math.prod(shape) * ITEMSIZES[dtype]
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


