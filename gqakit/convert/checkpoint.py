"""Streaming safetensors I/O: read a (sharded) checkpoint one tensor at a time, write size-capped
shards one tensor at a time, and publish the result atomically.

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
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import GqakitError

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
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise GqakitError(
            f"{path} is not a readable safetensors file ({e}); re-download or re-save the checkpoint"
        ) from None
    metadata = header.pop("__metadata__", None) or {}
    tensors, data_end = {}, 0
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            info = TensorInfo(path, entry["dtype"], tuple(entry["shape"]), 8 + n + begin, 8 + n + end)
            ok = entry["dtype"] in DTYPES and end - begin == info.nbytes
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise GqakitError(f"{path}: tensor '{name}' has a corrupt header entry; re-save the checkpoint")
        tensors[name] = info
        data_end = max(data_end, end)
    if 8 + n + data_end != size:
        raise GqakitError(
            f"{path} is truncated or corrupt: its header needs {8 + n + data_end} bytes, the file has "
            f"{size}; re-download or re-save the checkpoint"
        )
    return tensors, metadata


def scan_checkpoint(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of a safetensors checkpoint folder (single file or index + shards), validated."""
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise GqakitError(f"{index} is not a valid index ({e}); re-save the checkpoint") from None
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
        tensors.update(found)
    if weight_map is not None:
        absent = [k for k, s in weight_map.items() if k not in tensors]
        if absent:
            raise GqakitError(f"{index} lists '{absent[0]}' but no shard holds it; re-save the checkpoint")
    return tensors


def load_tensor(info: TensorInfo, name: str) -> torch.Tensor:
    """Read one tensor (the file is opened and closed around it, so no mapping outlives the read)."""
    with safe_open(str(info.file), framework="pt") as f:
        return f.get_tensor(name)


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


@contextmanager
def atomic_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it replaces `out`, on any failure it vanishes."""
    tmp = out.with_name(f".{out.name}.gqakit-tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            if not force:  # it appeared while we worked
                raise GqakitError(f"{out} already exists; pass --force to replace it or choose another -o")
            old = out.with_name(f".{out.name}.gqakit-old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
