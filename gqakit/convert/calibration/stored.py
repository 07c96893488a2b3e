"""A layer's calibration statistics and held-out windows on disk: one safetensors file per layer, written tensor by
tensor in row blocks and read back whole (`load_layer`) or an n x n statistic one block of rows at a time
(`StoredMoment`), so that no float32 copy of a whole float64 sum is ever made."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from gqakit.common.errors import GqakitError
from gqakit.convert.calibration.moments import F64, STATS
from gqakit.convert.calibration.streamed import BLOCK_BYTES, RowReader, row_blocks, write_from
from gqakit.hf.headers import read_header

MASK = "heldout.allowed"  # the one boolean tensor of a layer file (stored as U8)


def layer_path(folder: Path, layer: int) -> Path:
    return Path(folder) / f"layer-{layer:05d}.safetensors"


class LayerFile:
    """One layer's statistics and held-out windows as a safetensors file (float32; `MASK` as U8), written one
    tensor at a time, in any order: the header, with every tensor's shape, goes first, and each tensor is then
    written in row blocks of at most `BLOCK_BYTES` at its offset, so no float32 copy of a whole float64 sum is
    ever made. The file is removed if the `with` block ends early (an error) or leaves a tensor unwritten (which
    is then an error): its header is complete from the start, so a partial file would read as zeros."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]]):
        header, offset, self.where = {"__metadata__": {"format": "pt"}}, 0, {}
        for name, shape in shapes.items():
            nbytes = math.prod(shape) * (1 if name == MASK else 4)
            header[name] = {"dtype": "U8" if name == MASK else "F32", "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self.where[name] = (offset, tuple(shape))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
        self.path, self.base, self.missing = path, 8 + len(blob), set(shapes)
        self.file = open(path, "wb", buffering=0)
        self.file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, shape = self.where[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the header says {shape}")
        position = self.base + offset
        for block in row_blocks(tensor):
            block = block.to("cpu", torch.uint8 if name == MASK else torch.float32)
            write_from(self.file, block, position)
            position += block.numel() * block.element_size()
        self.missing.discard(name)

    def __enter__(self) -> "LayerFile":
        return self

    def __exit__(self, kind, *_) -> None:
        self.file.close()
        if kind is not None or self.missing:
            self.path.unlink()
        if kind is None and self.missing:
            raise RuntimeError(f"{self.path}: {sorted(self.missing)} never written")


def save_layer(folder: Path, layer: int, moments: dict, held: dict) -> Path:
    """One layer's statistics (any float dtype) and held-out windows as `LayerFile` (what calibration writes)."""
    tensors = {**moments, **{f"heldout.{k}": v for k, v in held.items()}}
    path = layer_path(folder, layer)
    with LayerFile(path, {name: tuple(v.shape) for name, v in tensors.items()}) as f:
        for name, v in tensors.items():
            f.write(name, v)
    return path


class StoredMoment:
    """One n x n statistic of `save_layer`'s file, read one block of rows at a time (a `grams.RowBlocks`), so that
    the merge never holds it whole: plain reads at its byte range, no mapping."""

    def __init__(self, folder: Path, layer: int, name: str):
        path = layer_path(folder, layer)
        info = read_header(path)[0][name]
        if info.dtype != "F32" or len(info.shape) != 2:
            raise GqakitError(f"{path}: '{name}' is not a float32 matrix; the calibration folder was changed")
        self.shape = tuple(info.shape)
        self._rows = RowReader(info, name, self.shape, "a calibration statistic")
        self._diagonal: torch.Tensor | None = None

    def rows(self, start: int, stop: int) -> torch.Tensor:
        stop = min(stop, self.shape[0])
        with open(self._rows.info.file, "rb", buffering=0) as f:
            return self._rows.read(f, start, stop)

    def diagonal(self) -> torch.Tensor:
        """Read once (the metric's ridge and the key bias's weight both use it)."""
        if self._diagonal is None:
            step = max(1, BLOCK_BYTES // (4 * self.shape[1]))
            self._diagonal = torch.cat([self.rows(i, i + step).diagonal(offset=i)
                                        for i in range(0, self.shape[0], step)])
        return self._diagonal


def load_layer(folder: Path, layer: int, keys: tuple[str, ...] = STATS, dtype: torch.dtype = F64,
               held: bool = True) -> tuple[dict, dict]:
    """One layer's statistics `keys` (in `dtype`; stored float32) and, with `held`, its held-out windows (else
    {}), read back from its `LayerFile`."""
    from safetensors import safe_open

    with safe_open(str(layer_path(folder, layer)), framework="pt") as f:
        moments = {k: f.get_tensor(k).to(dtype) for k in keys}
        windows = {k[len("heldout."):]: f.get_tensor(k) for k in f.keys() if held and k.startswith("heldout.")}
    if held:
        windows["allowed"] = windows["allowed"].bool()
    return moments, windows
