"""Streaming safetensors I/O: read a (sharded) checkpoint one tensor at a time, write size-capped
shards one tensor at a time; `publish.py` puts the result in place atomically.

The safetensors format is an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype, shape and byte range, and the raw bytes. Because a conversion knows every output
tensor's dtype and shape before it computes any of them, each shard's header is written first and
tensors are streamed in after it: peak memory is one tensor, whatever the shard or model size.
Tensors that do not change are copied byte for byte from the source file, never decoded.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from gqakit.common.errors import GqakitError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_COPY_CHUNK = 8 << 20


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
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


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
    if dtype not in DTYPES:
        raise GqakitError(f"{path}: tensor '{name}' has dtype {dtype}, which gqakit cannot convert (it reads "
                          f"{', '.join(DTYPES)}); convert a checkpoint saved in one of those")
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
    if index.is_file():
        weight_map = _read_index(index)
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise GqakitError(
                f"{index} names shard {missing[0]} which is missing from {model_dir}"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; download the complete checkpoint"
            )
    elif (model_dir / SINGLE).is_file():
        shards, weight_map = [SINGLE], None
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


def load_tensor(info: TensorInfo, name: str) -> torch.Tensor:
    """Read one tensor (`name` as it is called in its file) straight from its byte range.

    The header was validated by `read_header`, so the range is known; reading it with plain file I/O
    keeps no mapping open after the read and works for any path, including names that are not UTF-8
    (safetensors' own reader refuses those). Safetensors data is little-endian, as are the hosts torch
    supports.
    """
    if isinstance(info, DerivedTensor):
        tensor = info.make()
        if tuple(tensor.shape) != tuple(info.shape) or tensor.dtype != DTYPES[info.dtype]:
            raise AssertionError(f"derived tensor '{name}' came out {tensor.dtype} {list(tensor.shape)}, planned "
                                 f"{info.dtype} {list(info.shape)}")
        return tensor
    tensor = torch.empty(info.shape, dtype=DTYPES[info.dtype])
    with open(info.file, "rb", buffering=0) as f:
        return read_into(f, tensor, info.start,
                         f"{info.file} ended before tensor '{name}'; re-download or re-save the checkpoint")


def read_into(f, tensor: torch.Tensor, offset: int, error: str) -> torch.Tensor:
    """Fill the contiguous `tensor` from the open binary file `f` at byte `offset` (GqakitError `error` if the
    file ends first). Plain reads, never a mapping: mapped pages would count as this process's resident memory."""
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # the tensor's own storage, as bytes
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise GqakitError(error)
        done += n
    return tensor


def copy_bytes(info: TensorInfo, out) -> None:
    """Copy one tensor's raw bytes from its source file to the open output file.

    Uses `os.copy_file_range` (an in-kernel copy, no round trip through Python buffers) and falls back
    to a reused buffer where the kernel or file system cannot do it.
    """
    out.flush()  # the kernel copy writes at the descriptor's offset, after what Python buffered
    offset, left = info.start, info.end - info.start
    with open(info.file, "rb", buffering=0) as src:
        if hasattr(os, "copy_file_range"):
            try:
                while left:
                    n = os.copy_file_range(src.fileno(), out.fileno(), left, offset)
                    if n == 0:
                        break
                    offset += n
                    left -= n
            except OSError:
                pass  # e.g. EXDEV or EOPNOTSUPP: finish with the portable loop below
        src.seek(offset)
        buffer = memoryview(bytearray(min(left, _COPY_CHUNK)))
        while left:
            n = src.readinto(buffer[: min(left, len(buffer))])
            if not n:
                raise GqakitError(f"{info.file} ended early; re-download or re-save the checkpoint")
            out.write(buffer[:n])
            left -= n


def assign_shards(entries: list[tuple[str, str, tuple[int, ...]]], max_shard_bytes: int) -> list[list[int]]:
    """Split tensors (in order) into consecutive shards of at most `max_shard_bytes` each.

    A tensor larger than the cap gets a shard of its own, as `save_pretrained` does.
    """
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, dtype, shape) in enumerate(entries):
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class ShardWriter:
    """Write pre-planned shards tensor by tensor: headers up front, data streamed in order."""

    def __init__(self, folder: Path, entries: list[tuple[str, str, tuple[int, ...]]], max_shard_bytes: int):
        self.folder = folder
        self.entries = entries
        self.groups = assign_shards(entries, max_shard_bytes)
        self.names = shard_names(len(self.groups))
        self._shard_of = {i: s for s, idx in enumerate(self.groups) for i in idx}
        self._next = 0
        self._file = None

    def weight_map(self) -> dict[str, str]:
        return {self.entries[i][0]: self.names[s] for s, idx in enumerate(self.groups) for i in idx}

    def _open_shard(self, s: int):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for i in self.groups[s]:
            name, dtype, shape = self.entries[i]
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
        self._file = open(self.folder / self.names[s], "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)

    def _advance(self, name: str):
        i = self._next
        if i >= len(self.entries) or self.entries[i][0] != name:
            expected = self.entries[i][0] if i < len(self.entries) else "nothing"
            raise RuntimeError(f"write order broken: got {name}, expected {expected}")
        s = self._shard_of[i]
        if i == self.groups[s][0]:
            self.close()
            self._open_shard(s)
        self._next += 1
        return self.entries[i]

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        _, dtype, shape = self._advance(name)
        if DTYPE_NAMES[tensor.dtype] != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"{name}: planned {dtype}{list(shape)}, got {tensor.dtype}{list(tensor.shape)}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))

    def copy_tensor(self, name: str, info: TensorInfo) -> None:
        self._advance(name)
        copy_bytes(info, self._file)

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def finish(self) -> None:
        self.close()
        if self._next != len(self.entries):
            raise RuntimeError(f"only {self._next} of {len(self.entries)} planned tensors were written")
        if len(self.names) > 1:
            total = sum(math.prod(s) * DTYPES[d].itemsize for _, d, s in self.entries)
            index = {"metadata": {"total_size": total}, "weight_map": self.weight_map()}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
