"""Streaming safetensors I/O: read a (sharded) checkpoint one tensor at a time, write size-capped
shards one tensor at a time; `publish.py` puts the result in place atomically. The headers are read and the
shards planned in `headers.py`, torch-free.

The safetensors format is an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype, shape and byte range, and the raw bytes. Because a conversion knows every output
tensor's dtype and shape before it computes any of them, each shard's header is written first and
tensors are streamed in after it: peak memory is one tensor, whatever the shard or model size.
Tensors that do not change are copied byte for byte from the source file, never decoded.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from gqakit.common.errors import GqakitError
from gqakit.hf.headers import INDEX, DerivedTensor, TensorInfo, assign_shards, shard_names

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_COPY_CHUNK = 8 << 20


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
