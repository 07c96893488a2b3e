"""Data-free calibration samples kept on disk, so that a sweep over one model (latent ranks, methods, group counts)
draws the model's own text once: the second conversion reads the windows the first one sampled.

A sample is kept under a key that holds everything its token ids depend on, so a kept sample is exactly what
sampling again would give on this machine: the model (config.json's bytes, and the name, size, modification and
change times of every file in its folder: any rewrite of the weights makes a new key), the sampling (tokens, window,
seed, temperature, top-p, compute dtype), the code that samples (the sampler's source files, the gqakit, torch and
transformers versions), and what decides the arithmetic (the device, with the GPU's name, or the CPU's model and
torch's kernel level for it, the thread count). A stale sample is never read, it is only left for the user to
delete.

    $GQAKIT_CACHE_DIR/samples/KEY.safetensors   (default ~/.cache/gqakit/samples/)

Each file is one safetensors tensor, `windows` (N, window) int64, with the key's fields as its metadata; it is
written under the hidden working name of `common.atomic.sibling` and renamed into place, so a reader sees a whole
file or none, two processes sampling the same key at once both write the same bytes, and what a killed run left
the next one writing that key removes. A file that does not read back as the key says is ignored and sampled
anew. Delete the folder to take back the space.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from pathlib import Path

import torch

import gqakit

FORMAT = "gqakit-calibration-sample"
VERSION = 1
DEFAULT_ROOT = "~/.cache/gqakit/samples"
SAMPLER = ("gqakit.decode.sampling", "gqakit.decode.streaming", "gqakit.common.cpu_split",
           "gqakit.convert.calibration.sample", "gqakit.convert.calibration.data")  # the code a sample comes from


def cache_root() -> Path:
    """$GQAKIT_CACHE_DIR/samples (beside the token caches), else ~/.cache/gqakit/samples."""
    root = os.environ.get("GQAKIT_CACHE_DIR")
    return (Path(root) / "samples" if root else Path(DEFAULT_ROOT)).expanduser()


def _cpu_model() -> str | None:
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        found = None
    return found.group(1).strip() if found else platform.processor() or None


def _code() -> dict:
    """The versions and the sampler's own source files (an edit of an installed checkout changes no version)."""
    import importlib.util

    import transformers

    digest = hashlib.sha256()
    for name in SAMPLER:
        digest.update(Path(importlib.util.find_spec(name).origin).read_bytes())
    return {"gqakit": gqakit.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "sampler_sha256": digest.hexdigest()}


def _arithmetic(device: str) -> dict:
    """What decides the bits of a sampled token on this machine besides the model, the seed and the code."""
    kind = torch.device(device).type
    found = {"device": kind, "threads": torch.get_num_threads()}
    if kind == "cuda":
        found["gpu"] = torch.cuda.get_device_name(torch.device(device))
    else:
        found["cpu"] = _cpu_model()
        found["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return found


def sample_key(model_dir: Path, sampling: dict, device: str) -> dict:
    """The fields a kept sample must match (see the module docstring)."""
    stats = [(p.name, p.stat()) for p in Path(model_dir).iterdir() if p.is_file() and not p.name.startswith(".")]
    files = sorted((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for name, st in stats)
    config = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()
    return {"format": FORMAT, "version": VERSION, "config_sha256": config, "files": files, "sampling": sampling,
            **_code(), **_arithmetic(device)}


def _path(key: dict, root: Path) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return root / f"{name}.safetensors"


def load_sample(key: dict, root: Path | None = None) -> tuple[torch.Tensor, Path] | None:
    """The kept windows of `key` and their file, or None (none kept, or a file that is not what the key says)."""
    from safetensors import SafetensorError, safe_open

    try:
        path = _path(key, root or cache_root())  # cache_root: RuntimeError without a home folder
        with safe_open(str(path), framework="pt") as fh:
            if fh.metadata() != {"key": json.dumps(key, sort_keys=True)} or list(fh.keys()) != ["windows"]:
                return None
            windows = fh.get_tensor("windows")
    except (OSError, ValueError, RuntimeError, SafetensorError):  # absent, unreadable, not a safetensors file
        return None
    expected = (key["sampling"]["tokens"] // key["sampling"]["window"], key["sampling"]["window"])
    if windows.dtype != torch.int64 or tuple(windows.shape) != expected:
        return None
    return windows, path


def store_sample(key: dict, windows: torch.Tensor, root: Path | None = None) -> Path | None:
    """Keep `windows` under `key`; the file, or None where the cache folder cannot be written (the conversion goes
    on: a cache is an optimisation)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from gqakit.common.atomic import remove_stale_leftovers, sibling

    try:
        path = _path(key, root or cache_root())
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_leftovers(path)
        tmp = sibling(path, "tmp")
        try:
            save_file({"windows": windows.to(torch.int64).contiguous()}, str(tmp),
                      metadata={"key": json.dumps(key, sort_keys=True)})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, RuntimeError, SafetensorError):  # no home folder, a full disk, a quota (safetensors' own error)
        return None
    return path
