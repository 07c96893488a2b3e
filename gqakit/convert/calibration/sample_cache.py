"""Data-free calibration samples kept on disk, so that a sweep over one model (latent ranks, methods, group counts)
draws the model's own text once: the second conversion reads the windows the first one sampled.

A sample is kept under a key that holds everything its token ids depend on, so a kept sample is exactly what
sampling again would give on this machine: the model (config.json's bytes, and the name, size and modification
time of every file in its folder: any rewrite of the weights makes a new key), the sampling (tokens, window, seed,
temperature, top-p, compute dtype), and what decides the arithmetic (the device, with the GPU's name, torch's CPU
kernel level, the thread count, the torch version). What is not in the key is not kept: a stale sample is never
read, it is only left for the user to delete.

    $GQAKIT_CACHE_DIR/samples/KEY.safetensors   (default ~/.cache/gqakit/samples/)

Each file is one safetensors tensor, `windows` (N, window) int64, with the key's fields as its metadata; it is
written under a hidden working name and renamed into place, so a reader sees a whole file or none, and two
processes sampling the same key at once both write the same bytes. A file that does not read back as the key
says is ignored and sampled anew. Delete the folder to take back the space.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

FORMAT = "gqakit-calibration-sample"
VERSION = 1
DEFAULT_ROOT = "~/.cache/gqakit/samples"


def cache_root() -> Path:
    """$GQAKIT_CACHE_DIR/samples (beside the token caches), else ~/.cache/gqakit/samples."""
    root = os.environ.get("GQAKIT_CACHE_DIR")
    return (Path(root) / "samples" if root else Path(DEFAULT_ROOT)).expanduser()


def _arithmetic(device: str) -> dict:
    """What decides the bits of a sampled token on this machine besides the model and the seed."""
    kind = torch.device(device).type
    found = {"device": kind, "torch": torch.__version__, "threads": torch.get_num_threads()}
    if kind == "cuda":
        found["gpu"] = torch.cuda.get_device_name(torch.device(device))
    else:
        found["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return found


def sample_key(model_dir: Path, sampling: dict, device: str) -> dict:
    """The fields a kept sample must match (see the module docstring)."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).iterdir()
                   if p.is_file() and not p.name.startswith("."))
    config = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()
    return {"format": FORMAT, "version": VERSION, "config_sha256": config, "files": files, "sampling": sampling,
            **_arithmetic(device)}


def _path(key: dict, root: Path) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return root / f"{name}.safetensors"


def load_sample(key: dict, root: Path | None = None) -> tuple[torch.Tensor, Path] | None:
    """The kept windows of `key` and their file, or None (none kept, or a file that is not what the key says)."""
    from safetensors import SafetensorError, safe_open

    path = _path(key, root or cache_root())
    try:
        with safe_open(str(path), framework="pt") as fh:
            if fh.metadata() != {"key": json.dumps(key, sort_keys=True)} or list(fh.keys()) != ["windows"]:
                return None
            windows = fh.get_tensor("windows")
    except (OSError, ValueError, SafetensorError):  # absent, unreadable, or not a whole safetensors file
        return None
    expected = (key["sampling"]["tokens"] // key["sampling"]["window"], key["sampling"]["window"])
    if windows.dtype != torch.int64 or tuple(windows.shape) != expected:
        return None
    return windows, path


def store_sample(key: dict, windows: torch.Tensor, root: Path | None = None) -> Path | None:
    """Keep `windows` under `key`; the file, or None where the cache folder cannot be written (the conversion goes
    on: a cache is an optimisation)."""
    from safetensors.torch import save_file

    path = _path(key, root or cache_root())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file({"windows": windows.to(torch.int64).contiguous()}, tmp,
                      metadata={"key": json.dumps(key, sort_keys=True)})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        return None
    return path
